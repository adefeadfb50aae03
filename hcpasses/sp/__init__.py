"""The SP rewrite's parts: region analysis (``region``) and emission (``emit``); the pass is
:mod:`hcpasses.sp_rewrite`."""
