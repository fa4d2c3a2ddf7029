"""The ``cuda`` backend: kernel specialisations (:mod:`.spec`), toolchain discovery
(:mod:`.toolchain`), build-on-first-use with an on-disk cache (:mod:`.jit`) and the backend
(:mod:`.backend`). Importing it never touches CUDA or runs nvcc."""
