"""Hand-written everyday requests for measuring draft-head acceptance on ordinary traffic.

Written for this benchmark (not taken from any data set) and never trained on: scripts/make_eagle_data.py drops
any ShareGPT prompt whose normalized text equals one of these, and a test checks the training data for them.
"""

from __future__ import annotations

EVERYDAY_PROMPTS: list[str] = [
    # cooking
    "How do I make a simple tomato soup at home?",
    "What can I cook for dinner tonight with rice, eggs and some frozen peas?",
    "My bread always comes out dense. What am I doing wrong?",
    "Give me a shopping list for a vegetarian lasagna for six people.",
    # travel
    "I have three days in Lisbon. What should I see?",
    "What should I pack for a week of hiking in the mountains in autumn?",
    "Is it better to take the train or fly from Paris to Amsterdam?",
    "How can I avoid jet lag on a long flight to Japan?",
    # maths word problems
    "A shop sells pencils at 3 for 75 cents. How much do 12 pencils cost?",
    "A train leaves at 2:15 pm and travels 180 km at 60 km per hour. When does it arrive?",
    "If I save 150 dollars a month, how long will it take me to save 2,400 dollars?",
    "A rectangle is twice as long as it is wide and its perimeter is 36 cm. What are its sides?",
    # code
    "Write a Python function that checks whether a string is a palindrome.",
    "How do I read a CSV file in JavaScript and print each row?",
    "What does this SQL do: SELECT name, COUNT(*) FROM orders GROUP BY name;",
    "Explain the difference between a list and a tuple in Python with an example.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    # letters and emails
    "Write a short email to my landlord asking him to fix the heating.",
    "Help me write a thank-you note to my grandmother for the birthday sweater.",
    "Draft a polite message declining a job offer.",
    "Write a cover letter opening paragraph for a junior accountant position.",
    # summaries and explanations
    "Summarize the story of Romeo and Juliet in a few sentences.",
    "Summarize the main causes of the First World War.",
    "Explain how a credit score works.",
    "What is the difference between weather and climate?",
    "Explain what inflation is to a teenager.",
    # jokes and creative writing
    "Tell me a joke about cats.",
    "Write a funny limerick about a forgetful robot.",
    "Write a four-line birthday poem for my best friend.",
    "Tell me a short bedtime story about a brave little turtle.",
    # advice and everyday life
    "How can I get better sleep when I work night shifts?",
    "What are some good ways to stay motivated when learning the guitar?",
    "My houseplant has yellow leaves. What could be the cause?",
    "How do I remove a red wine stain from a carpet?",
    "Give me five ideas for a rainy-day activity with kids.",
    "What questions should I ask when viewing an apartment to rent?",
    "How do I prepare for a job interview at a bank?",
    "Suggest a weekly workout plan for a beginner with no equipment.",
    "What are the pros and cons of buying a used car?",
    "Translate 'Where is the train station, please?' into Spanish and French.",
]
