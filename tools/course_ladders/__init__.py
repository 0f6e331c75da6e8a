"""The ladders of tools/course.py, one module per group of chapters (docs/course/)."""
