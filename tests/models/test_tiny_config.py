"""`TinyModelConfig` refuses shapes that transformers would reject later, naming the key."""

from __future__ import annotations

import pytest

from gcore_rl.configlib import from_dict
from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TOKENIZER_SIZE, TinyModelConfig, build_char_tokenizer


@pytest.mark.parametrize(("overrides", "key"), [
    ({"hidden_size": -3}, "hidden_size"),
    ({"num_layers": 0}, "num_layers"),
    ({"hidden_size": 30}, "hidden_size"),  # not a multiple of 4 heads
    ({"hidden_size": 20}, "hidden_size"),  # head dimension 5 is odd
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"vocab_size": 5}, "vocab_size"),
])
def test_impossible_shapes_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as raised:
        from_dict(TinyModelConfig, overrides)
    assert raised.value.key == key


def test_the_default_shape_is_valid_and_the_tokenizer_size_is_known():
    from_dict(TinyModelConfig, {})
    assert TOKENIZER_SIZE == len(build_char_tokenizer())
