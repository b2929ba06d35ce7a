//! The serializer that carries an [`EncodeContext`] through a value: a wrapper around the
//! format's serializer that hands every nested value the same context, and that alone knows
//! what to do with a remote reference (the newtype struct named [`RREF_TOKEN`]).

use std::fmt::Display;

use serde::ser::{self, Serialize, Serializer};

use super::{EncodeContext, Failure, RREF_TOKEN};

/// A value to serialize with the context (what the format's compound serializers are given).
struct Wrap<'c, 'a, T: ?Sized> {
    value: &'c T,
    ctx: &'c EncodeContext<'a>,
}

impl<T: Serialize + ?Sized> Serialize for Wrap<'_, '_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.value
            .serialize(Encoder::new(serializer, self.ctx))
            .map_err(|f| self.ctx.errors.lower(f))
    }
}

/// The format's serializer `S`, with the encode's context.
pub(super) struct Encoder<'c, 'a, S> {
    inner: S,
    ctx: &'c EncodeContext<'a>,
}

impl<'c, 'a, S> Encoder<'c, 'a, S> {
    pub(super) fn new(inner: S, ctx: &'c EncodeContext<'a>) -> Self {
        Self { inner, ctx }
    }
}

/// One of the format's compound serializers (sequence, tuple, map, struct...), with the context.
pub(super) struct Compound<'c, 'a, C> {
    inner: C,
    ctx: &'c EncodeContext<'a>,
}

/// The format's compound serializer as `made`, with the context.
fn compound<'c, 'a, C, E: Display>(
    ctx: &'c EncodeContext<'a>,
    made: Result<C, E>,
) -> Result<Compound<'c, 'a, C>, Failure> {
    match made {
        Ok(inner) => Ok(Compound { inner, ctx }),
        Err(e) => Err(ctx.errors.lift(e)),
    }
}

/// Forwards a primitive to the format's serializer.
macro_rules! primitive {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
        fn $method(self, v: $ty) -> Result<S::Ok, Failure> {
            let ctx = self.ctx;
            self.inner.$method(v).map_err(|e| ctx.errors.lift(e))
        }
    )*};
}

impl<'c, 'a, S: Serializer> Serializer for Encoder<'c, 'a, S> {
    type Ok = S::Ok;
    type Error = Failure;
    type SerializeSeq = Compound<'c, 'a, S::SerializeSeq>;
    type SerializeTuple = Compound<'c, 'a, S::SerializeTuple>;
    type SerializeTupleStruct = Compound<'c, 'a, S::SerializeTupleStruct>;
    type SerializeTupleVariant = Compound<'c, 'a, S::SerializeTupleVariant>;
    type SerializeMap = Compound<'c, 'a, S::SerializeMap>;
    type SerializeStruct = Compound<'c, 'a, S::SerializeStruct>;
    type SerializeStructVariant = Compound<'c, 'a, S::SerializeStructVariant>;

    primitive!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_f32(f32),
        serialize_f64(f64),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_unit_struct(&'static str),
    );

    fn serialize_none(self) -> Result<S::Ok, Failure> {
        let ctx = self.ctx;
        self.inner.serialize_none().map_err(|e| ctx.errors.lift(e))
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<S::Ok, Failure> {
        let ctx = self.ctx;
        let value = Wrap { value, ctx };
        self.inner
            .serialize_some(&value)
            .map_err(|e| ctx.errors.lift(e))
    }

    fn serialize_unit(self) -> Result<S::Ok, Failure> {
        let ctx = self.ctx;
        self.inner.serialize_unit().map_err(|e| ctx.errors.lift(e))
    }

    fn serialize_unit_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
    ) -> Result<S::Ok, Failure> {
        let ctx = self.ctx;
        self.inner
            .serialize_unit_variant(name, index, variant)
            .map_err(|e| ctx.errors.lift(e))
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result<S::Ok, Failure> {
        let ctx = self.ctx;
        if name == RREF_TOKEN {
            // A remote reference: forked for the destination, and the fork is what travels.
            let data = ctx.fork(value)?;
            return data.serialize(self.inner).map_err(|e| ctx.errors.lift(e));
        }
        let value = Wrap { value, ctx };
        self.inner
            .serialize_newtype_struct(name, &value)
            .map_err(|e| ctx.errors.lift(e))
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, Failure> {
        let ctx = self.ctx;
        let value = Wrap { value, ctx };
        self.inner
            .serialize_newtype_variant(name, index, variant, &value)
            .map_err(|e| ctx.errors.lift(e))
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Self::SerializeSeq, Failure> {
        compound(self.ctx, self.inner.serialize_seq(len))
    }

    fn serialize_tuple(self, len: usize) -> Result<Self::SerializeTuple, Failure> {
        compound(self.ctx, self.inner.serialize_tuple(len))
    }

    fn serialize_tuple_struct(
        self,
        name: &'static str,
        len: usize,
    ) -> Result<Self::SerializeTupleStruct, Failure> {
        compound(self.ctx, self.inner.serialize_tuple_struct(name, len))
    }

    fn serialize_tuple_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeTupleVariant, Failure> {
        compound(
            self.ctx,
            self.inner
                .serialize_tuple_variant(name, index, variant, len),
        )
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Self::SerializeMap, Failure> {
        compound(self.ctx, self.inner.serialize_map(len))
    }

    fn serialize_struct(
        self,
        name: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStruct, Failure> {
        compound(self.ctx, self.inner.serialize_struct(name, len))
    }

    fn serialize_struct_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStructVariant, Failure> {
        compound(
            self.ctx,
            self.inner
                .serialize_struct_variant(name, index, variant, len),
        )
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

impl<'c, 'a, C> Compound<'c, 'a, C> {
    fn wrap<'v, T: ?Sized>(&self, value: &'v T) -> Wrap<'v, 'a, T>
    where
        'c: 'v,
    {
        Wrap {
            value,
            ctx: self.ctx,
        }
    }

    fn lift<E: Display>(&self, e: E) -> Failure {
        self.ctx.errors.lift(e)
    }
}

/// Implements one of serde's compound-serializer traits for [`Compound`], forwarding each
/// element (wrapped with the context) and the end.
macro_rules! compound {
    ($trait:ident, $($method:ident($($arg:ident: $ty:ty),*)),*) => {
        impl<C: ser::$trait> ser::$trait for Compound<'_, '_, C> {
            type Ok = C::Ok;
            type Error = Failure;

            $(fn $method<T: Serialize + ?Sized>(
                &mut self,
                $($arg: $ty,)*
                value: &T,
            ) -> Result<(), Failure> {
                let value = self.wrap(value);
                let out = self.inner.$method($($arg,)* &value);
                out.map_err(|e| self.lift(e))
            })*

            fn end(self) -> Result<C::Ok, Failure> {
                let ctx = self.ctx;
                self.inner.end().map_err(|e| ctx.errors.lift(e))
            }
        }
    };
}

compound!(SerializeSeq, serialize_element());
compound!(SerializeTuple, serialize_element());
compound!(SerializeTupleStruct, serialize_field());
compound!(SerializeTupleVariant, serialize_field());
compound!(SerializeMap, serialize_key(), serialize_value());
compound!(SerializeStruct, serialize_field(key: &'static str));
compound!(SerializeStructVariant, serialize_field(key: &'static str));
