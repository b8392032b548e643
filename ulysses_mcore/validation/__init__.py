"""Validation, run once per call signature: one rank's checks (``checks``), the record the ranks
compare and its verdict (``record``), and the agreements that keep a cached call honest
(``agreement``)."""
