/* Status codes returned by every te_fuser C kernel entry point. */
#ifndef TF_STATUS_H
#define TF_STATUS_H

typedef enum tf_status {
  TF_OK = 0,
  TF_ERR_NULL_POINTER = 1,   /* a required pointer was NULL */
  TF_ERR_BAD_SIZE = 2,       /* a size was negative or inconsistent */
  TF_ERR_OVERFLOW = 3,       /* an index computation would overflow int64 */
  TF_ERR_BAD_DTYPE = 4,      /* a dtype the kernel does not handle */
  TF_ERR_BAD_ARGUMENT = 5,   /* any other argument outside its domain */
  TF_ERR_CUDA = 6            /* a CUDA launch failed */
} tf_status;

/* A short English description of a status, for error messages. */
const char *tf_status_string(tf_status status);

#endif /* TF_STATUS_H */
