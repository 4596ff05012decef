"""The decode engine: batched plain and speculative generation, the static (shape-stable, graph-captured) path,
sampling and lossless verification, draft trees."""
