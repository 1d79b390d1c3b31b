"""What each decoding step may and may try to produce, decided on the issuing node, pure:
structured outputs' grammars (``grammar``), speculative drafts and their length
(``speculate``), a draft model's tokenizer check (``draft``), and the prefix cache's index of
prompt blocks (``prefix``)."""
