"""End-to-end tests by topic: the training loop, its checkpoints and the command-line tools, in real processes."""
