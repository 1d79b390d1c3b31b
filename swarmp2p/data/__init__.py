"""Training and evaluation data: text/JSONL files, the embedded corpus, HF datasets."""
