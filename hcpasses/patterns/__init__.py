"""HC patterns as plain torch functions, and their traced Inductor pattern-matcher forms."""
