"""The kernels, run on the gathered sequence for this rank's heads: the registry (``registry``),
torch's SDPA (``sdpa``), flash-attn (``flash``), Transformer Engine (``te``), packed documents
(``varlen``), the tiled log-sum-exp engine (``blocks``, ``tiled``) and its walk over a ring of
ranks (``ring``)."""
