"""A grammar of transformer code: configs drawn part by part (``config``), each part a real spelling
found in the wild (``parts``, ``attention``), composed into an ``nn.Module`` (``model``) and checked
against one device (``check``): the parallel model is equal or refuses with a clear error."""
