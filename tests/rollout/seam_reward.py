"""A reward that varies on a random tiny model (the share of digits in the completion), so a step trains."""


def digit_share(prompt: str, completion: str, **row) -> float:
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
