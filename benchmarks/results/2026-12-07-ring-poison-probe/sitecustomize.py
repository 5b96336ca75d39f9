import os
if os.environ.get('MEGAMOE_POISON_PROBE'):
    import poison  # noqa: F401
