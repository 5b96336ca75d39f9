"""The standalone launches, each beside its pure-PyTorch twin: expert GEMMs, quantisers, dispatch / combine."""
