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
