"""Cache policies (installed as kvjax.policies): one file per policy."""
