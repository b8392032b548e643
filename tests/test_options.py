"""ulysses_mcore.options: one hashable record per call site, built once."""

from ulysses_mcore.options import AttentionOptions, attention_options, has_window, options_set


def test_same_values_give_the_same_record():
    a = attention_options(True, layout="sbhd", backend="sdpa", softmax_scale=0.125)
    assert a is attention_options(True, layout="sbhd", backend="sdpa", softmax_scale=0.125)  # a dict lookup
    assert a == AttentionOptions(True, "sbhd", "sdpa", 0.125) and hash(a) == hash(
        AttentionOptions(True, "sbhd", "sdpa", 0.125)
    )
    assert attention_options(False) is not attention_options(True)
    assert attention_options(True, window_size=[4, 0]).window_size == (4, 0)  # a list becomes hashable


def test_values_reach_the_validator_as_given():
    """causal=1 equals True and dropout_p=False equals 0.0 as dict keys: the cached record of one must
    not stand in for the other, or the validator would never see the bad value."""
    good = attention_options(True, dropout_p=0.0)
    assert attention_options(1).causal == 1 and type(attention_options(1).causal) is int
    assert attention_options(True, dropout_p=False).dropout_p is False
    assert attention_options(True, dropout_p=0.0) is good


def test_unhashable_values_are_kept_for_the_validator():
    rec = attention_options(True, softmax_scale=[1.0])
    assert rec.softmax_scale == [1.0]


def test_window_and_variant_names():
    assert attention_options(True, window_size=(-1, -1)).window is None
    assert attention_options(True, window_size=(8, 0)).window == (8, 0)
    assert not has_window(None) and not has_window((-1, -1)) and has_window((0, -1))
    assert options_set((8, 0), None, True) == ["window_size", "return_lse"]
    assert options_set() == []


def test_options_are_named_and_an_unknown_one_is_refused():
    import pytest

    with pytest.raises(TypeError, match="unknown option.*'windw'"):
        attention_options(True, windw=(4, 0))


def test_kernel_keywords_carry_the_options_in_use_only():
    assert attention_options(True).kernel_keywords("sbhd") == dict(causal=True, softmax_scale=None, layout="sbhd")
    kw = attention_options(False, window_size=(-1, -1), dropout_p=0.1, return_lse=True).kernel_keywords("bshd")
    assert kw == dict(causal=False, softmax_scale=None, layout="bshd", dropout_p=0.1, return_lse=True)
