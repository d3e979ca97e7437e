"""What every benchmark shares: the method protocol and the loops that time methods
(:mod:`.method`), the adapters of the compared libraries (:mod:`.adapters`: trainsnap,
``torch.save``, DCP) and of the disk's limit (:mod:`.raw`), the report and its verdicts
(:mod:`.report`), the command line (:mod:`.cli`), the machine (:mod:`.system`); and what the
benchmarks measure on: synthetic states (:mod:`.state`, :mod:`.sharded_state`), trained models
(:mod:`.training`), a compute loop slowed by a draining save (:mod:`.compute`).

Not part of trainsnap: internal to ``benchmarks``.
"""
