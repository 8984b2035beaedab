"""Component tests by topic (one folder per area of the package), multi-process gloo tests of one part included."""
