"""The static check of candidate source, run in bounded worker processes."""
