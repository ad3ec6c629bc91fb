"""What users run: the CLI (``cli``, its shared flags in ``options``), the edge's OpenAI-compatible endpoint (``edge``,
``edge_pool``, ``openai_request``), the demo, and the text a generation shows (``text``, ``private`` spans)."""
