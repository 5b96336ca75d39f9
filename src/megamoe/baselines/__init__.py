"""Implementations megamoe is measured against."""
