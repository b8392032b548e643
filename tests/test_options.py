"""ulysses_mcore.options: one hashable record per call site, and what each kernel can take."""

from ulysses_mcore.options import CallSite, call_site, has_window, options_set


def test_same_values_give_equal_records():
    a = call_site(True, layout="sbhd", backend="sdpa", softmax_scale=0.125)
    assert a == call_site(True, layout="sbhd", backend="sdpa", softmax_scale=0.125)
    assert a == CallSite(True, "sbhd", "sdpa", 0.125) and hash(a) == hash(CallSite(True, "sbhd", "sdpa", 0.125))
    assert call_site(False) != call_site(True)
    assert call_site(True, window_size=[4, 0]).window_size == (4, 0)  # a list becomes hashable


def test_values_reach_the_validator_as_given():
    """causal=1 equals True and dropout_p=False equals 0.0 as dict keys: the record keeps each as given,
    or the validator would never see the bad value."""
    assert call_site(1).causal == 1 and type(call_site(1).causal) is int
    assert call_site(True, dropout_p=False).dropout_p is False
    assert type(call_site(True, dropout_p=0.0).dropout_p) is float


def test_unhashable_values_are_kept_for_the_validator():
    rec = call_site(True, softmax_scale=[1.0])
    assert rec.softmax_scale == [1.0]


def test_window_and_variant_names():
    assert call_site(True, window_size=(-1, -1)).window is None
    assert call_site(True, window_size=(8, 0)).window == (8, 0)
    assert not has_window(None) and not has_window((-1, -1)) and has_window((0, -1))
    assert options_set((8, 0), None, True) == ["window_size", "return_lse"]
    assert options_set() == []


def test_options_are_named_and_an_unknown_one_is_refused():
    import pytest

    with pytest.raises(TypeError, match="unknown field.*'windw'"):
        call_site(True, windw=(4, 0))


def test_kernel_keywords_carry_the_options_in_use_only():
    assert call_site(True).kernel_keywords("sbhd") == dict(causal=True, softmax_scale=None, layout="sbhd")
    kw = call_site(False, window_size=(-1, -1), dropout_p=0.1, return_lse=True).kernel_keywords("bshd")
    assert kw == dict(causal=False, softmax_scale=None, layout="bshd", dropout_p=0.1, return_lse=True)


def test_the_per_call_table_names_every_per_call_field():
    """PER_CALL is the one table of CallTensors' fields: each field in it, in order, and what the ranks
    compare is also keyed (a compared field that were not in the key could change unseen)."""
    from ulysses_mcore.options import PER_CALL, CallTensors

    assert tuple(PER_CALL) == CallTensors._fields
    assert all(f.key for f in PER_CALL.values() if f.compared)
    assert {f.compared for f in PER_CALL.values()} <= {None, "sig", "values"}
