"""ulysses_mcore.validation.checks: one rank's own checks, read by name off the call site and its data; the
first problem in table order wins, and a check never raises (its problem is returned)."""

import torch

from ulysses_mcore.validation.checks import LOCAL_CHECKS, UNREAD, CallView, int_list, local_problem
from ulysses_mcore.options import NO_TENSORS, CallTensors, call_site


def view(q, k=None, v=None, tensors=NO_TENSORS, sizes=(2, 1), **options):
    k = q if k is None else k
    v = q if v is None else v
    site = call_site(options.pop("causal", True), **options, checks=(("expected_heads", (4, 4)),))
    return CallView((q, k, v), site, tensors, sizes)


def test_a_good_call_has_no_problem():
    assert local_problem(view(torch.randn(8, 1, 4, 16))) == ""


def test_each_concern_names_its_problem():
    q = torch.randn(8, 1, 4, 16)
    cases = [
        (view(q, causal=1), "causal must be True or False, got 1"),
        (view(q, k=q.double()), "must share one dtype"),
        (view(q, k=torch.randn(8, 1, 4, 8)), "disagree in head dim"),
        (view(torch.randn(8, 1, 2, 16)), "the module was built for 4 query / 4 kv heads"),
        (view(q, dropout_p=2.0), "dropout_p must be a number in [0, 1], got 2.0"),
        (view(q, window_size=(4,)), "window_size must be a pair"),
        (view(q, tensors=CallTensors(attention_mask=torch.zeros(1, 1, 16, 16))), "attention_mask must be a bool"),
        (view(q, tensors=CallTensors(qkv_format="bshd")), "qkv_format='bshd'"),
    ]
    for call, want in cases:
        assert want in local_problem(call), (want, local_problem(call))


def test_the_first_concern_in_table_order_wins():
    """A call with a bad flag and a bad dtype: the flag's check runs first."""
    q = torch.randn(8, 1, 4, 16)
    call = view(q, k=q.double(), causal="yes")
    first = next(check(call) for check in LOCAL_CHECKS if check(call))
    assert local_problem(call) == first and "causal" in first


def test_boundaries_are_read_once_and_never_from_a_tensor_without_values():
    assert int_list(torch.tensor([0, 3, 8])) == (0, 3, 8)
    assert int_list(torch.empty(3, dtype=torch.int64, device="meta")) == (UNREAD,) * 3
    assert int_list(torch.tensor([0.0, 1.0])) is None and int_list(None) is None
