"""Test doubles for sddoctor's edges, for tests and benchmarks; nothing at run time imports them.

fake_nvml   a pynvml stand-in (`set_nvml_for_tests(FakeNvml(...))`): `NvmlSource` itself runs
            on a machine without a GPU, with deterministic values
"""
