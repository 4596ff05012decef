"""Fixed benchmark prompts: 8 math word problems and 8 instructions."""

MATH = [
    "Tom has 3 apples and buys 5 more. He gives 2 to Anna. How many apples does he have now? Explain step by step.",
    "A train travels 60 km per hour for 3 hours, then 40 km per hour for 2 hours. How far does it travel in total?",
    "Sara reads 12 pages a day. Her book has 180 pages. How many days does she need to finish it? Show your work.",
    "A shop sells pencils at 4 for 1 dollar. How much do 26 pencils cost? Explain your reasoning.",
    "There are 24 students in a class. One third of them play football and half of the rest play chess. "
    "How many students play chess?",
    "A rectangle is 7 cm long and 4 cm wide. What are its area and its perimeter? Solve step by step.",
    "Ben saves 15 dollars every week. How many weeks does he need to save 240 dollars? Think step by step.",
    "A baker makes 9 trays of 12 cookies and sells 75 cookies. How many cookies are left? Explain.",
]

INSTRUCTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold, in simple words.",
    "List five tips for writing clean Python code, with one sentence for each.",
    "Describe the water cycle to a ten-year-old.",
    "Write an email to a colleague asking to move our meeting from Monday to Wednesday.",
    "Explain the difference between a list and a tuple in Python, with an example of each.",
    "Give me a recipe for a simple tomato pasta, with ingredients and steps.",
    "Summarize the benefits of regular exercise in one paragraph.",
]

PROMPTS = MATH + INSTRUCTIONS
