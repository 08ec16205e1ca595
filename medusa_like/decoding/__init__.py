"""The inference core: trees, the tree KV cache, tree attention backends, the decoding loop and sampling. It never
imports training code."""
