"""The prompts the shipped SmolLM2 drafter was trained on (and its held-out evaluation): reasoning-gym questions of
20 tasks and chat requests from templates, all generated locally (offline)."""

from __future__ import annotations

import random

TASKS = ["gsm_symbolic", "basic_arithmetic", "chain_sum", "leg_counting", "fraction_simplification", "gcd", "lcm",
         "prime_factorization", "letter_counting", "number_sorting", "simple_equations", "word_sorting",
         "spell_backward", "caesar_cipher", "family_relationships", "time_intervals", "decimal_arithmetic",
         "count_bits", "calendar_arithmetic", "products"]
INSTRUCTIONS = [" Think step by step.", " Give only the final answer."]
CHAT_TEMPLATES = [
    "Explain {topic} to a ten-year-old.", "Write a short poem about {topic}.", "Give me three tips about {topic}.",
    "What are the pros and cons of {topic}?", "Summarize the history of {topic} in a paragraph.",
    "Write a friendly email inviting a colleague to talk about {topic}.", "What is {topic}?",
    "List five facts about {topic}.", "How do I get started with {topic}?", "Tell me a short story about {topic}.",
]
CHAT_TOPICS = [
    "the moon", "photosynthesis", "learning to cook", "saving money", "the water cycle", "volcanoes", "chess",
    "recycling", "the internet", "healthy sleep", "gardening", "the solar system", "writing a resume", "bicycles",
    "rainforests", "public speaking", "the ocean", "music practice", "time management", "friendship", "dinosaurs",
    "electric cars", "bread baking", "climate", "learning a language", "honeybees", "mountains", "coffee",
    "video games", "libraries", "running", "the human heart", "painting", "trains", "birds", "meditation",
]
EVAL_CHAT_TOPICS = [
    "glaciers", "knitting", "the printing press", "submarines", "owls", "tea ceremonies", "basketball", "deserts",
    "origami", "lighthouses", "penguins", "jazz", "wind power", "bridges", "mushrooms", "the Roman empire",
]
TEMPERATURES = (0.6, 0.8, 1.0, 0.0)  # the policy's answers the shipped drafter learns from: sampled, and greedy


def prompt_mix(tokenizer, count: int, seed: int, topics: list[str] = CHAT_TOPICS) -> list[str]:
    """``count`` chat-formatted prompts: three in four reasoning-gym questions (20 tasks, two instructions), one in
    four chat requests (templates x ``topics``). Other seeds give other questions; held-out evaluation also uses
    other topics (``EVAL_CHAT_TOPICS``)."""
    import reasoning_gym

    rng = random.Random(seed)
    questions = count * 3 // 4
    per_task = -(-questions // (len(TASKS) * len(INSTRUCTIONS)))
    texts = []
    for t, task in enumerate(TASKS):
        data = list(reasoning_gym.create_dataset(task, size=per_task * len(INSTRUCTIONS), seed=seed * 100 + t))
        for i, item in enumerate(data):
            texts.append(item["question"] + INSTRUCTIONS[i % len(INSTRUCTIONS)])
    rng.shuffle(texts)
    texts = texts[:questions]
    texts += [rng.choice(CHAT_TEMPLATES).format(topic=rng.choice(topics)) for _ in range(count - questions)]
    rng.shuffle(texts)
    return [chat_prompt(tokenizer, text) for text in texts]


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as the user's turn in the tokenizer's chat template, ready for the answer (``text`` itself where the
    tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


# ---------------------------------------------------------------------------------------------------------------------
# The broad mix (issue 53): every reasoning-gym task that generates offline, more instructions, longer chat requests,
# code, and second turns of conversations, with task families held out for evaluation.

# Tasks never sampled for training: evaluation and "a task absent from all shipped data" (GRPO runs on a new task)
HELD_OUT_TASKS = ["count_primes", "decimal_chain_sum", "power_function", "number_filtering", "string_insertion",
                  "syllogism", "rotate_matrix", "word_ladder", "knights_knaves", "polynomial_multiplication"]
# Every other task of reasoning-gym 0.1 that generates offline, in a few seconds at most (arc_agi, codeio and
# composite are left out: slow, prompts over a thousand tokens, or a container of the others)
BROAD_TASKS = sorted(set(TASKS) | {
    "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "base_conversion", "bf", "binary_alternation",
    "binary_matrix", "bitwise_arithmetic", "boxnet", "circuit_logic", "coin_flip", "color_cube_rotation",
    "complex_arithmetic", "countdown", "course_schedule", "cryptarithm", "dice", "emoji_mystery", "figlet_font",
    "futoshiki", "game_of_life", "game_of_life_halting", "graph_color", "group_anagrams", "intermediate_integration",
    "isomorphic_strings", "jugs", "kakurasu", "knight_swap", "largest_island", "letter_jumble", "list_functions",
    "mahjong_puzzle", "manipulate_matrix", "maze", "mini_sudoku", "modulo_grid", "n_queens", "needle_haystack",
    "number_format", "number_sequence", "palindrome_generation", "palindrome_partitioning", "path_star",
    "polynomial_equations", "pool_matrix", "propositional_logic", "puzzle24", "quantum_lock", "ransom_note", "rearc",
    "rectangle_count", "rotten_oranges", "rubiks_cube", "rush_hour", "self_reference", "sentence_reordering",
    "shortest_path", "simple_geometry", "simple_integration", "sokoban", "spiral_matrix", "string_manipulation",
    "string_splitting", "string_synthesis", "sudoku", "survo", "tower_of_hanoi", "tsumego", "word_sequence_reversal",
    "zebra_puzzles"} - set(HELD_OUT_TASKS))
BROAD_INSTRUCTIONS = INSTRUCTIONS + [
    "", " Explain your reasoning briefly.", " Show your work, then give the answer on the last line.",
    " Answer, then check your answer.",
]
LONG_CHAT_TEMPLATES = [
    "Write a detailed guide to {topic}, with headings.", "Write an essay of four paragraphs about {topic}.",
    "Compare {topic} with something similar, point by point.", "Plan a one-week lesson on {topic} for a class.",
    "Write a blog post about {topic} for beginners.", "Answer as an expert: what do most people get wrong about "
    "{topic}?", "Describe a day in the life of someone who works with {topic}.",
    "Write a dialogue between two friends discussing {topic}.",
]
BROAD_CHAT_TOPICS = CHAT_TOPICS + [
    "the stock market", "vaccines", "ancient Egypt", "black holes", "urban planning", "first aid", "pottery",
    "board games", "wolves", "the Olympics", "earthquakes", "solar panels", "volunteering", "podcasts", "camping",
    "the immune system", "robots", "fermentation", "classical music", "rivers",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a sentence", "merges two sorted lists", "removes duplicates from a list while keeping "
    "order", "finds the largest number in a list", "converts Celsius to Fahrenheit", "checks whether a string is a "
    "palindrome", "computes the factorial of a number", "flattens a nested list", "sorts a list of dictionaries by a "
    "key", "counts how often each letter appears in a text", "returns the second largest number in a list",
    "checks whether two strings are anagrams", "computes the average of a list of numbers", "reads a CSV file and "
    "prints its rows", "finds the common elements of two lists", "converts a number to binary", "capitalizes every "
    "word in a sentence", "validates an email address", "computes the greatest common divisor of two numbers",
    "groups a list of words by their first letter", "returns the indices of two numbers that add up to a target",
]
CODE_TEMPLATES = [
    "Write a Python function that {task}.", "Write a Python function that {task}. Add a docstring and an example.",
    "How would you write a JavaScript function that {task}?", "Write a unit test for a Python function that {task}.",
    "Explain, step by step, how to write a function that {task}.",
]
FOLLOW_UPS = ["Can you make it shorter?", "Can you give me an example?", "Why is that?", "Can you explain that in "
              "more detail?", "Thanks! Can you summarize that in one sentence?", "What should I do next?",
              "Are you sure? Please check it again."]
# The mix's shares: reasoning-gym questions, chat requests (one in three long), code requests; a share of the chat and
# code conversations gets a second turn (the follow-up to the policy's own first answer)
BROAD_SHARES = {"task": 0.6, "chat": 0.28, "code": 0.12}
SECOND_TURN_SHARE = 0.4


def broad_prompt_mix(count: int, seed: int, held_out: bool = False) -> list[dict]:
    """``count`` first-turn requests of the broad mix, each ``{"text", "source"}`` (source: ``task:<name>``, ``chat``,
    ``chat-long`` or ``code``). ``held_out``: the held-out task families and chat topics instead (evaluation); training
    seeds must differ from evaluation seeds too (the sampler's start at 1000, evaluation's at 7)."""
    import reasoning_gym

    rng = random.Random(seed)
    tasks = HELD_OUT_TASKS if held_out else BROAD_TASKS
    topics = EVAL_CHAT_TOPICS if held_out else BROAD_CHAT_TOPICS
    questions = round(count * BROAD_SHARES["task"])
    code = round(count * BROAD_SHARES["code"])
    picks = [rng.choice(tasks) for _ in range(questions)]
    items: list[dict] = []
    for t, task in enumerate(sorted(set(picks))):
        wanted = picks.count(task)
        data = list(reasoning_gym.create_dataset(task, size=wanted, seed=seed * 1000 + t))
        for item in data:
            items.append({"text": item["question"] + rng.choice(BROAD_INSTRUCTIONS), "source": f"task:{task}"})
    for _ in range(code):
        items.append({"text": rng.choice(CODE_TEMPLATES).format(task=rng.choice(CODE_TASKS)), "source": "code"})
    while len(items) < count:
        long = rng.random() < 1 / 3
        template = rng.choice(LONG_CHAT_TEMPLATES if long else CHAT_TEMPLATES)
        items.append({"text": template.format(topic=rng.choice(topics)), "source": "chat-long" if long else "chat"})
    rng.shuffle(items)
    return items[:count]


PROMPT_SETS = ("seeds", "families")


def evaluation_prompts(tokenizer, count: int, prompt_set: str = "seeds", seed: int = 7) -> list[str]:
    """``count`` chat-formatted held-out prompts to measure a drafter on.

    ``seeds``: the 20-task mix of :func:`prompt_mix` at an evaluation seed, with other chat topics: held out from the
    first shipped drafter's data by seed and topic, but the broad mix trains on the same task families.
    ``families``: the broad mix's held-out task families and chat topics (``HELD_OUT_TASKS``, ``EVAL_CHAT_TOPICS``),
    held out from every shipped data by family and seed: what a drafter meets on a task nobody trained it for."""
    if prompt_set == "seeds":
        return prompt_mix(tokenizer, count, seed=seed, topics=EVAL_CHAT_TOPICS)
    if prompt_set == "families":
        return [chat_prompt(tokenizer, item["text"]) for item in broad_prompt_mix(count, seed, held_out=True)]
    raise ValueError(f"prompt_set={prompt_set!r}: choose from {PROMPT_SETS}.")


def follow_up(seed: int, index: int) -> str:
    """The second-turn request of conversation ``index`` of a shard sampled with ``seed``."""
    return random.Random(seed * 1_000_003 + index).choice(FOLLOW_UPS)
