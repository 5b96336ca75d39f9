"""Developer tools that run no layer: the offline sm_90 build check."""
