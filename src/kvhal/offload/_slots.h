/* kvhal.offload._keyindex's slots part (_slots.c): the LRU type and the states' functions. */
#ifndef KVHAL_SLOTS_H
#define KVHAL_SLOTS_H
#include <Python.h>
#include <stdint.h>

/* ``obj``'s slots as C ints in [0, limit) (None as -1 where ``none_ok``); PyMem, NULL on error. */
int32_t *kvhal_slot_ints(PyObject *obj, Py_ssize_t limit, Py_ssize_t *n, int none_ok);
extern PyMethodDef kvhal_slot_functions[];
int kvhal_add_slot_types(PyObject *module);

#endif
