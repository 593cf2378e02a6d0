"""attnlab engine: adapters, interventions, summaries and the Gaussian model.

Nothing in this package imports the web layer; `app` depends on it, never the reverse.
"""
