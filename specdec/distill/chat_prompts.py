"""Chat prompts for self-distillation: many kinds of request over many subjects, none of the benchmarks'.

An EAGLE head learns the target's answers, so what it generalises to is what its prompts cover. The first shipped
head was trained on 12 templates x 40 topics and memorised them (70% of its drafts accepted there, 14-20% on new
prompts). This module crosses 19 kinds of request (stories, poems, explanations, advice, descriptions, code,
comparisons, retellings, how-tos, emails, ...) with subject lists of their own, several thousand prompts in all,
and takes them round-robin over the kinds so that any count is balanced. Once a kind's own prompts run out it
goes on with them asked in other ways (``STYLES``: shorter, in detail, for a child, ...), so that a few thousand
prompts are not mostly stories, the largest kind.

Held out: every prompt of the benchmarks (``specdec/assets/prompts``) and every prompt that names one of their
subjects (``BENCHMARK_SUBJECTS``: no robot, no ocean, no palindrome, ...), so that benchmarking on them measures
prompts the head has not seen, nor near copies of them.
"""

from __future__ import annotations

import json
import random
from importlib import resources

# The benchmarks' subjects (benchmarks/bench_eagle3.py, bench_drafting.py): no training prompt names one.
BENCHMARK_SUBJECTS = ("robot", "photosynthesis", "palindrome", "new language", "ocean", "sky", "bank",
                      "mountain village", "season", "paper airplane", "camping", "limerick about a cat", "cheese",
                      "riding hood", "first job", "exercise", "rainbow", "mood")

_CHARACTERS = ["a young fox", "an old fisherman", "a shy giraffe", "a clockmaker", "a curious squirrel",
               "a retired astronaut", "a brave little mouse", "a librarian", "a lonely cloud", "a street musician",
               "a grandmother", "a lighthouse keeper", "a baker", "a penguin", "a detective", "a tiny dragon",
               "a farmer", "a friendly ghost", "a knight", "a scarecrow", "an owl", "a teenage inventor",
               "a mail carrier", "a sea turtle", "a school teacher", "a tailor", "a wizard's apprentice",
               "a firefighter", "a hedgehog", "a pirate"]
_PLOTS = ["wants to fly", "finds a secret door", "loses a precious key", "learns to swim",
          "makes an unlikely friend", "travels to a distant city", "discovers a hidden talent",
          "is afraid of the dark", "builds a boat", "plants a magic seed", "forgets their own name",
          "wins a contest", "searches for a missing sister", "opens a tiny shop", "hears a strange song at night",
          "gets lost in a maze", "finds an old letter", "tries to stop a storm", "befriends a giant",
          "keeps a big secret", "moves to a new town", "finds a map in the attic", "cannot stop sneezing",
          "trains for a race", "collects rare stones", "writes letters to the stars", "saves a town from a flood",
          "meets their future self", "repairs a broken clock tower", "wakes up in a different century"]
_POEM_SUBJECTS = ["autumn leaves", "a busy train station", "the first snowfall", "an empty playground",
                  "a candle in the window", "the desert wind", "a summer thunderstorm", "a river in spring",
                  "a cup of tea", "the city at midnight", "a field of sunflowers", "an old oak tree",
                  "the stars over a farm", "a foggy harbor", "homesickness", "a quiet library",
                  "a kite on a windy day", "the last day of school", "a hummingbird", "morning fog", "a lost glove",
                  "a mountain lake", "a grandfather's watch", "fireflies", "the sound of rain on a roof",
                  "a long road trip", "winter mornings", "a garden after the rain", "an old bicycle",
                  "a new baby sister", "a crowded bus", "a forgotten song", "a bowl of soup", "the wind in the wheat",
                  "a stray dog", "a birthday candle", "the end of summer", "a snail", "an open window",
                  "a pair of old boots"]
_SCIENCE = ["a refrigerator", "the immune system", "gravity", "a vaccine", "electricity", "a solar panel",
            "the stock market", "inflation", "a compass", "the tides", "an earthquake", "the greenhouse effect",
            "a microwave oven", "digestion", "the water cycle", "compound interest", "a neural network", "GPS",
            "a bicycle's gears", "the human heart", "a black hole", "DNA", "a battery", "recycling",
            "yeast making bread rise", "the phases of the moon", "a thermostat", "blood types", "sleep",
            "a camera", "the internet", "a rocket engine", "evolution", "clouds", "a volcano", "magnets", "sound",
            "a mobile phone network", "plate tectonics", "bees making honey", "antibiotics", "a hybrid car",
            "composting", "the printing press", "a Roman aqueduct", "supply and demand", "a credit score",
            "lightning", "a hydroelectric dam", "the human eye"]
_ACTIVITIES = ["saving money for a holiday", "studying for an exam", "running a first marathon",
               "keeping houseplants alive", "cooking for a large family", "moving to a new city",
               "writing a cover letter", "learning to play the guitar", "getting up earlier",
               "organizing a small kitchen", "speaking in public", "making friends as an adult", "training a puppy",
               "planning a wedding on a budget", "reducing screen time", "taking better photos with a phone",
               "starting a vegetable garden", "negotiating a salary", "staying focused while working from home",
               "hosting a dinner party", "preparing for an interview", "learning to draw",
               "traveling with small children", "baking sourdough bread", "keeping a journal", "reading more books",
               "buying a used car", "dealing with stress", "teaching a child to ride a bike",
               "preparing meals for the week", "writing a novel", "building a birdhouse",
               "caring for an elderly parent", "choosing a laptop", "decluttering a closet", "learning to knit",
               "running a book club", "coaching a youth soccer team", "giving feedback to a coworker",
               "sleeping better"]
_SCENES = ["a busy market in the morning", "a quiet beach in winter", "an old bookshop",
           "a thunderstorm over the plains", "a cozy cabin in the woods", "a night train crossing the desert",
           "a school cafeteria at lunchtime", "a hot air balloon festival", "a harbor at sunrise",
           "a crowded subway car", "a farmhouse kitchen", "an abandoned amusement park", "a museum at closing time",
           "a spring festival in a town square", "a rooftop garden in a big city", "a frozen lake",
           "a jungle after heavy rain", "a small cafe on an island", "the ruins of a castle", "a school science fair",
           "a wedding reception", "a bakery before dawn", "a football stadium on match day", "a hospital at night",
           "a vineyard at harvest time", "an airport departure hall", "a snowy city street", "a street parade",
           "a quiet temple garden", "a laundromat on a Sunday"]
_CODE_TASKS = ["reverses a linked list", "counts the vowels in a string", "returns the n-th Fibonacci number",
               "merges two sorted lists", "finds the largest number in a list", "converts Celsius to Fahrenheit",
               "checks whether a number is prime", "removes duplicates from a list while keeping the order",
               "sorts a list of dictionaries by a key", "reads a CSV file and sums one column",
               "flattens a nested list", "counts how often each word appears in a text",
               "validates an email address with a regular expression", "computes the factorial of a number",
               "finds the second smallest element of a list", "checks whether two strings are anagrams",
               "returns the greatest common divisor of two numbers", "converts a Roman numeral to an integer",
               "implements binary search", "rotates a square matrix by 90 degrees",
               "capitalizes the first letter of each word", "generates a random password",
               "computes the average of a list of numbers", "keeps only the even numbers of a list",
               "parses a date string into year, month and day", "counts the lines of a text file",
               "turns a list of pairs into a dictionary", "checks whether the parentheses in a string are balanced",
               "finds the longest word in a sentence", "returns the sum of the digits of an integer",
               "implements bubble sort", "converts a decimal number to binary",
               "finds the common elements of two lists", "splits a list into chunks of size n",
               "computes the distance between two points", "transposes a matrix", "prints FizzBuzz up to n",
               "finds the most common character in a string", "checks whether a year is a leap year",
               "returns the n largest values of a list"]
_CODE_CLASSES = ["a to-do list with add and remove methods", "a shopping cart that totals its items",
                 "a library book with checkout and return methods", "a 2D vector with addition and length",
                 "a simple stopwatch", "a student with a list of grades and an average",
                 "a deck of playing cards that can shuffle and deal", "a rectangle with area and perimeter",
                 "a counter that can be incremented and reset", "an inventory of products and quantities",
                 "a queue with a maximum size", "a contact book with search", "a parking lot with free spaces",
                 "a temperature log with minimum and maximum", "a simple cache with a size limit"]
_PAIRS = ["cats and dogs as pets", "trains and planes for travel", "tea and coffee",
          "reading books and watching films", "living in a city and in the countryside", "Python and JavaScript",
          "renting and buying a home", "summer and winter holidays", "paper books and e-readers",
          "working from home and working in an office", "walking and cycling to work", "a laptop and a tablet",
          "public and private schools", "fresh and frozen vegetables", "team sports and solo sports",
          "emails and phone calls", "savings accounts and index funds", "printed maps and GPS apps"]
_TALES = ["the story of the Three Little Pigs", "the story of Cinderella", "the fable of the tortoise and the hare",
          "the story of Goldilocks and the three bears", "the story of Jack and the Beanstalk",
          "the fable of the boy who cried wolf", "the story of Hansel and Gretel", "the story of the ugly duckling",
          "the story of Snow White", "the story of the emperor's new clothes", "the story of Rapunzel",
          "the legend of Robin Hood", "the myth of King Midas", "the legend of King Arthur's sword",
          "the story of Pinocchio", "the story of the Pied Piper", "the fable of the ant and the grasshopper",
          "the myth of Icarus"]
_FAVOURITES = ["book", "food", "holiday", "animal", "city", "sport", "kind of film", "time of day", "board game",
               "kind of music", "colour", "dessert", "childhood game", "place to relax", "smell", "word"]
_OCCASIONS = ["a day at the beach", "a job interview", "a picnic in the park", "a music festival", "a long flight",
              "the first week at university", "a ski trip", "a short hospital stay", "a road trip with friends",
              "a potluck dinner", "a wedding", "a hiking day in the hills", "a business trip", "a sleepover"]
_HOW_TOS = ["make pancakes", "tie a tie", "change a flat tire", "brew good coffee", "fold a fitted sheet",
            "set up a fish tank", "start a podcast", "make a monthly budget", "grow tomatoes",
            "clean a cast iron pan", "write a haiku", "make a kite", "bake chocolate chip cookies", "iron a shirt",
            "carve a pumpkin", "make pizza dough at home", "plant a tree", "sharpen a kitchen knife",
            "make lemonade", "remove a coffee stain", "back up my photos", "learn to juggle", "unclog a drain",
            "make a paper boat"]
_GOOD_FOR = ["drinking enough water", "getting enough sleep", "reading to children", "eating vegetables",
             "spending time outdoors", "learning history", "saying thank you", "keeping in touch with friends",
             "taking breaks at work", "laughing", "learning to cook", "volunteering", "keeping a routine",
             "listening to music", "writing things down"]
_EMAIL = [("a colleague", "moving a meeting to Friday"), ("a neighbour", "a noisy party next weekend"),
          ("a teacher", "a child's missed homework"), ("a landlord", "a broken heater"),
          ("a team", "a new lunch schedule"), ("a customer", "a delayed order"),
          ("a friend", "a surprise birthday plan"), ("a manager", "asking for a day off"),
          ("a club", "changes to the membership fee"), ("a hotel", "an early check-in"),
          ("a new coworker", "welcoming them to the team"), ("a plumber", "a leaking sink"),
          ("a library", "a lost book"), ("a coach", "missing practice next week")]

# Ways to ask a kind's prompts again once its own run out: each gives the target's answer another shape.
STYLES = (" Keep it short.", " Make it detailed.", " Write it for a young child.", " Use simple words.",
          " Make it funny.", " Use a few bullet points where they help.", " Start with a one-sentence summary.",
          " Answer in a friendly tone.")

_KINDS: list[tuple[list[str], list[str]]] = [
    (["Write a short story about {} who {}.", "Tell me a bedtime story about {} who {}.",
      "Write the opening of a novel about {} who {}.", "Write a fable about {} who {}, with a moral at the end."],
     [f"{c}\x00{p}" for c in _CHARACTERS for p in _PLOTS]),
    (["Write a poem about {}.", "Write a haiku about {}.", "Write a short rhyming poem about {}.",
      "Write a limerick about {}.", "Write the chorus of a song about {}."], _POEM_SUBJECTS),
    (["Explain how {} works in simple terms.", "Explain {} to a ten-year-old.", "What is {} and why does it matter?",
      "Give a short explanation of {}.", "What are three interesting facts about {}?"], _SCIENCE),
    (["What are some good tips for {}?", "What advice would you give someone who is {}?",
      "How can I get better at {}?", "Give me a step-by-step plan for {}.",
      "What mistakes should I avoid when {}?"], _ACTIVITIES),
    (["Describe {}.", "Describe {} in vivid detail.", "Paint a picture in words of {}.",
      "Describe the sounds and smells of {}."], _SCENES),
    (["Write a Python function that {}.", "Write a JavaScript function that {}.",
      "Show me a Python function that {}, with a short explanation.", "How do I write code that {}?"],
     _CODE_TASKS),
    (["Write a Python class for {}.", "Write a JavaScript class for {}."], _CODE_CLASSES),
    (["Compare {}.", "What are the differences between {}?", "Which is better: {}? Give reasons."], _PAIRS),
    (["Retell {} in your own words.", "Summarize {} in a few sentences.", "What is the lesson of {}?"], _TALES),
    (["Tell me about your favourite {} and why you like it.", "What is your favourite {}, and why?"], _FAVOURITES),
    (["What should I bring to {}?", "Make a checklist for {}."], _OCCASIONS),
    (["How do I {}?", "What is the easiest way to {}?", "Give me step-by-step instructions to {}."], _HOW_TOS),
    (["Why is {} good for you?", "What are the benefits of {}?"], _GOOD_FOR),
    (["Write a short email to {} about {}.", "Write a polite message to {} about {}."],
     [f"{who}\x00{what}" for who, what in _EMAIL]),
    (["Write a short speech for {}.", "Write a toast for {}."],
     ["a friend's wedding", "a retirement party", "a school graduation", "a team's end-of-year dinner",
      "a grandparent's 80th birthday", "the opening of a new library"]),
    (["Give me five ideas for {}.", "Brainstorm some ideas for {}."],
     ["a rainy weekend", "a science project", "a small business", "a birthday gift for a dad", "a short film",
      "a school fundraiser", "a themed dinner", "a garden on a balcony", "a family reunion", "a board game"]),
    (["Write a product description for {}.", "Write a short advertisement for {}."],
     ["a reusable water bottle", "a pair of running shoes", "a handmade candle", "a folding bicycle",
      "a smart alarm clock", "a children's picture book", "a wool winter hat", "a coffee grinder"]),
    (["What happened during {}?", "Tell me about {}."],
     ["the first moon landing", "the building of the pyramids", "the invention of the telephone",
      "the Renaissance", "the gold rush in California", "the first Olympic Games", "the fall of the Berlin Wall",
      "the voyage of the Mayflower", "the age of the dinosaurs", "the invention of the light bulb"]),
    (["Write a diary entry of {}.", "Write a letter from {} to a friend."],
     ["a soldier in a castle", "a girl on her first day in a new country", "an explorer in the Arctic",
      "a cat watching the street", "a student before an exam", "a chef on a busy night", "a zookeeper",
      "a child at a summer fair"]),
]


def _benchmark_prompts() -> set[str]:
    held: set[str] = set()
    for name in ("drafting.json", "chat.json", "short.json"):
        try:
            data = json.loads(resources.files("specdec").joinpath(f"assets/prompts/{name}").read_text())
        except (OSError, ValueError):
            continue
        held |= {p for v in data.values() if isinstance(v, list) for p in v if isinstance(p, str)}
    return held


def base_prompt(prompt: str) -> str:
    """The prompt without a ``STYLES`` ending (a kind's own prompt)."""
    for style in STYLES:
        if prompt.endswith(style):
            return prompt[: -len(style)]
    return prompt


def names_a_benchmark_subject(prompt: str) -> bool:
    low = prompt.lower()
    return any(s in low for s in BENCHMARK_SUBJECTS)


def chat_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct chat prompts, taken round-robin over the kinds (each kind's prompts shuffled by ``seed``,
    then the same asked in the ``STYLES``, shuffled); none is a benchmark prompt or names a benchmark subject.
    ``chat_prompts(n)`` begins with ``chat_prompts(m)`` for m < n."""
    held = _benchmark_prompts()
    rng = random.Random(seed)
    pools = []
    for templates, subjects in _KINDS:
        pool = [t.format(*s.split("\x00")) for t in templates for s in subjects]
        pool = [p for p in dict.fromkeys(pool) if p not in held and not names_a_benchmark_subject(p)]
        rng.shuffle(pool)
        pools.append(pool)
    styled = random.Random(f"{seed}-styles")
    for pool in pools:
        more = [p + style for p in pool for style in STYLES]
        styled.shuffle(more)
        pool.extend(p for p in more if p not in held)
    out: list[str] = []
    depth = 0
    while len(out) < n and any(depth < len(p) for p in pools):
        out.extend(p[depth] for p in pools if depth < len(p))
        depth += 1
    return out[:n]
