"""The model library: local model folders, what each model is, whether it can load and fit."""
