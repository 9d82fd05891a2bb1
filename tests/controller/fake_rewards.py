"""The rule reward of the fake-slice jobs (tests/controller/fake_slice.py): the share of "1"s in a completion."""


def ones_share(prompt: str, completion: str, **_) -> float:
    return completion.count("1") / max(1, len(completion))
