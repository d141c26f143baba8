"""The conversation list: a Qt model over the store's conversations and the pane showing it."""
