"""Directory put first on ``PYTHONPATH`` by ``acshim run --children``: its ``sitecustomize`` makes
child Python processes (torchrun workers, multiprocessing spawn) install acshim's patches."""
