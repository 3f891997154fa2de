/* placeholder: filled in by the owning module */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_cxor", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__cxor(void) { return PyModule_Create(&mod); }
