"""The exchange: which heads go where (``heads``), the shape-fixed plans of one all-to-all
(``routes``), the collective and its buffers (``transport``), the autograd pair around the kernel
(``pair``), head chunks pipelined against the kernel (``overlap``) and the token orders (``orders``)."""
