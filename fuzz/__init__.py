"""Coverage-guided fuzzing (atheris) of the code that reads untrusted bytes: see fuzz/run.py."""
