"""Tools for developers, outside the attention core: the fake world (a cluster's GPUs sized on fake
CUDA without one: ``fakeworld``), the benchmark harness (``bench``), helper processes that die with
their rank (``lifetime``) and the flags' help lines (``flags``)."""
