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


_NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sofia", "Omar", "Lena", "Kenji", "Zara", "Maria", "David",
          "Aisha", "Pierre", "Yuki", "Carlos", "Nina", "Sam", "Fatima", "Jonas"]
_ITEMS = ["apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards", "oranges", "cupcakes",
          "toy cars", "flowers", "eggs", "stamps", "shells", "balloons"]
_MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more. How many {item} does {a} have now? Explain step by step.",
    "{a} buys {x} packs of {item} with {y} in each pack. How many {item} is that in total? Show your work.",
    "{a} had {x} {item} and gave {y} to {b}. How many {item} are left? Think step by step.",
    "{a} shares {x} {item} equally among {y} friends. How many does each friend get, and how many are left?",
    "A box holds {y} {item}. How many boxes does {a} need for {x} {item}? Explain your reasoning.",
    "{a} earns {y} dollars a day. How many days does {a} need to save {x} dollars? Solve it step by step.",
    "A car drives {x} km per hour for {y} hours. How far does it go? Explain your answer.",
    "{a} is {y} years old. {b} is {x} years older. How old will {b} be in {y} years? Think step by step.",
    "A garden is {x} meters long and {y} meters wide. What is its area? What is its perimeter? Show your work.",
    "{a} runs {y} km every day for {x} days. How many km is that in total? Explain.",
    "A ticket costs {y} dollars. {a} buys tickets for {x} people. How much does {a} pay? Solve step by step.",
    "{a} reads {y} pages every evening. The book has {x} pages. After how many evenings is it finished?",
    "A class of {x} students splits into teams of {y}. How many full teams are there, and how many students "
    "are left over?",
    "{a} had {x} dollars, spent {y} dollars on lunch and twice as much on a book. How much money is left?",
    "A tank holds {x} liters and leaks {y} liters per hour. How long until it is empty? Explain your reasoning.",
    "{a} bakes {y} trays of {item} with {x} on each tray and gives away half. How many are left? Show your work.",
]
_TOPICS = ["the moon", "volcanoes", "bees", "the internet", "rainbows", "trains", "chess", "coffee", "rivers",
           "batteries", "dinosaurs", "libraries", "airplanes", "the ocean", "forests", "bicycles", "music",
           "the heart", "clouds", "electricity", "bread", "photosynthesis", "magnets", "earthquakes", "penguins",
           "the solar system", "vaccines", "money", "maps", "computers", "solar panels", "glaciers", "tea",
           "the human brain", "sleep", "recycling", "bridges", "elections", "deserts", "whales", "friendship",
           "gardening", "the printing press", "cameras", "robots", "football", "cheese", "telescopes", "mountains",
           "windmills", "ants", "the weather", "smartphones", "castles", "the olympics", "honey", "owls",
           "video games", "the post office", "hospitals"]
_INSTRUCTION_TEMPLATES = [
    "Explain {t} in simple words.", "Write a short poem about {t}.",
    "Give three interesting facts about {t}.", "Write a short story that involves {t}.",
    "Describe {t} to a ten-year-old.", "List the pros and cons of {t}.",
    "Write a short blog post about {t}.", "What are the most common misconceptions about {t}?",
    "Write a dialogue between a teacher and a student about {t}.", "Give me five quiz questions about {t}, "
    "with answers.", "Explain why {t} are important in everyday life.", "Write a product description for a book "
    "about {t}.", "Summarize the history of {t} in one paragraph.", "Write a letter to a friend about {t}.",
    "Give me a step-by-step plan to learn about {t} in a week.", "Compare {t} and {u}.",
    "Write a short speech about {t} for a school assembly.", "Explain {t} as if I were a complete beginner.",
    "What would happen if there were no {t}?", "Write a haiku about {t}, then explain it.",
    "Give me a list of ten words related to {t}, with a short definition of each.",
    "Write a news report about a surprising discovery involving {t}.",
    "Write an email to my team announcing a workshop about {t}.",
    "Give me tips for a beginner who is interested in {t}.",
]
_DRIFT_TEMPLATES = [
    "Write a Python function that {task}. Explain the code.",
    "Translate this sentence into French and explain the grammar: '{s}'",
    "Summarize in two sentences: {s}",
]
_TASKS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a word",
          "returns the largest of three numbers", "sums a list of numbers", "removes duplicates from a list"]
_SENTENCES = ["The cat sleeps on the warm chair.", "We will visit the museum tomorrow.",
              "My brother likes to play football after school.", "The weather is cold and rainy today."]


def synthetic_prompts(num: int, seed: int = 0, kind: str = "mixed") -> list[str]:
    """Templated prompts: "math" word problems, "instructions", "mixed" (both, alternating), or
    "drift" (code, translation, summaries: a different distribution, for drift experiments)."""
    import random

    if kind not in ("math", "instructions", "mixed", "drift"):
        raise ValueError(f"kind must be math, instructions, mixed or drift, got {kind!r}")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        pick = kind if kind != "mixed" else ("math" if i % 2 == 0 else "instructions")
        if pick == "math":
            a, b = rng.sample(_NAMES, 2)
            out.append(rng.choice(_MATH_TEMPLATES).format(a=a, b=b, x=rng.randint(10, 99), y=rng.randint(2, 9),
                                                          item=rng.choice(_ITEMS)))
        elif pick == "instructions":
            t, u = rng.sample(_TOPICS, 2)
            out.append(rng.choice(_INSTRUCTION_TEMPLATES).format(t=t, u=u))
        else:
            out.append(rng.choice(_DRIFT_TEMPLATES).format(task=rng.choice(_TASKS), s=rng.choice(_SENTENCES)))
    return out
