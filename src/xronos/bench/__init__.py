"""``xronos bench``: every strategy on the same emulated cluster, the same loop, interleaved;
the report (``bench.json``, the table, ``bench.png``) and the named scenarios."""
