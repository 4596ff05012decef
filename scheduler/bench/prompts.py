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


_NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sofia", "Omar", "Lena", "Kenji", "Zara"]
_ITEMS = ["apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards"]
_MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more. How many {item} does {a} have now? Explain step by step.",
    "{a} buys {x} packs of {item} with {y} in each pack. How many {item} is that in total? Show your work.",
    "{a} had {x} {item} and gave {y} to {b}. How many {item} are left? Think step by step.",
    "{a} shares {x} {item} equally among {y} friends. How many does each friend get, and how many are left?",
    "A box holds {y} {item}. How many boxes does {a} need for {x} {item}? Explain your reasoning.",
    "{a} earns {y} dollars a day. How many days does {a} need to save {x} dollars? Solve it step by step.",
]
_TOPICS = ["the moon", "volcanoes", "bees", "the internet", "rainbows", "trains", "chess", "coffee", "rivers",
           "batteries", "dinosaurs", "libraries"]
_INSTRUCTION_TEMPLATES = [
    "Explain how {t} work, in simple words.", "Write a short poem about {t}.",
    "Give three interesting facts about {t}.", "Write a short story that involves {t}.",
    "Describe {t} to a ten-year-old.", "List the pros and cons of {t}.",
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
            out.append(rng.choice(_INSTRUCTION_TEMPLATES).format(t=rng.choice(_TOPICS)))
        else:
            out.append(rng.choice(_DRIFT_TEMPLATES).format(task=rng.choice(_TASKS), s=rng.choice(_SENTENCES)))
    return out
