"""The testbed: scenarios, clusters of workers, collectives, metrics and reports."""
