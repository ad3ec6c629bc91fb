"""Training drafters: the data they learn from (``datasets``) and, later, the loops that train them."""
