"""The CLI's client side: what each command asks the local daemon (over `node/api.py`'s socket) and how it prints. Never imports the daemon."""
