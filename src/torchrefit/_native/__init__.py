"""``watch="every"``'s optional native checks: the C++ checks themselves and where they
are built (``watch``), and their build in the background (``build``)."""
