"""The C kernels of the CPU path: sources (one .c per kernel family, pagoda_cpu.h shared), the build of
their variants ahead of run time (`build`), the table of their C signatures (`signatures`) and the loader
that picks the variant this CPU runs best (`loader`). The engine's bindings wrap them for torch tensors."""
