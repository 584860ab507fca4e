/*
 * Python module init of te_fuser._C, in C against the limited API (abi3).
 * The module itself is empty: importing it loads the shared library, whose
 * static initializers register the te_fuser ops with the torch dispatcher.
 */
#include <Python.h>

static struct PyModuleDef te_fuser_c_module = {
    PyModuleDef_HEAD_INIT, "_C", "te_fuser kernels (ops live in torch.ops.te_fuser)", -1,
    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&te_fuser_c_module); }
