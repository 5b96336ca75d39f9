"""Benchmark harness, seeded problems and reports for `megamoe bench`."""
