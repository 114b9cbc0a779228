"""What the tests and the benchmarks both use: the wire fuzzer's generators and judge (``fuzz``), a client's
bytes on the wire counted (``wire.count_wire``). Nothing of the product imports it."""
